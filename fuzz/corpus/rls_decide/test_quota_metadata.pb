
test-domain

service	service_1

unspecv
	
accta


router