


tenantt0


tenantt1


tenantt2


tenantt3


tenantt4


tenantt5


tenantt6


tenantt7


tenantt8


tenantt9